"""Run a worker whose role defaults to ``both``."""

from services.engine.process import worker_main


def main() -> None:
    worker_main("both")


if __name__ == "__main__":
    main()
