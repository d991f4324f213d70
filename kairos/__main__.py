from kairos.cli import main

main()
