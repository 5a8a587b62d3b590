from services.prefill_worker.main import main

main()
