from services.planner.main import main

main()
