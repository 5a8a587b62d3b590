from bus.runtime import without_websockets

without_websockets()

from services.ingress.main import main  # noqa: E402 - after the call above

main()
