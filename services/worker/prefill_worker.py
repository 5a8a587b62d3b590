"""The prefill worker: ``python -m services.worker.prefill_worker`` starts a worker in role
``prefill``."""

from services.worker.runtime import worker_main


def main() -> None:
    worker_main("prefill")


if __name__ == "__main__":
    main()
