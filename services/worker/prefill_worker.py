"""The prefill worker: ``python -m services.worker.prefill_worker`` starts a worker in role
``prefill``."""

from services.worker.entry import start

if __name__ == "__main__":
    start("prefill")
