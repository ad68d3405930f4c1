"""``python -m hybrid_offload ...`` runs the ``hybrid-offload`` command line."""

from hybrid_offload.tools.cli.main import main

raise SystemExit(main())
