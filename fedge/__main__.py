from fedge.cli import main

raise SystemExit(main())
