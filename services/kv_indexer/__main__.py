from bus.runtime import without_websockets

without_websockets()

from services.kv_indexer.main import main  # noqa: E402 - after the call above

main()
