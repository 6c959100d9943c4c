from kvstore.planner.cli import main

raise SystemExit(main())
