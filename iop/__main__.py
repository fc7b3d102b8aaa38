from iop.cli import main

raise SystemExit(main())
