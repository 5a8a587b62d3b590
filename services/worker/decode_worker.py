"""The decode worker: ``python -m services.worker.decode_worker`` starts a worker in role
``decode`` (``LANEWAY_ROLE=both`` serves requests end to end, aggregated)."""

from services.worker.runtime import worker_main


def main() -> None:
    worker_main("decode")


if __name__ == "__main__":
    main()
