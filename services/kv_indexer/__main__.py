from services.kv_indexer.main import main

main()
