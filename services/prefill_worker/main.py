"""Run a worker whose role defaults to ``prefill``."""

from services.engine.process import worker_main


def main() -> None:
    worker_main("prefill")


if __name__ == "__main__":
    main()
