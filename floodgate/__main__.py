from floodgate.cli import main

raise SystemExit(main())
