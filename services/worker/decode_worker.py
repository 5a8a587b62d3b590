"""The decode worker: ``python -m services.worker.decode_worker`` starts a worker in role
``decode`` (``LANEWAY_ROLE=both`` serves requests end to end, aggregated)."""

from services.worker.entry import start

if __name__ == "__main__":
    start("decode")
