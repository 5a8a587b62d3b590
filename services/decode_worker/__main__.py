from services.decode_worker.main import main

main()
