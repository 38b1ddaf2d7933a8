from verl_agent.cli import main

raise SystemExit(main())
