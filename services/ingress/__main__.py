from services.ingress.main import main

main()
