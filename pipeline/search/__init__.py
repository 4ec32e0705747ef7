"""The search: candidates judged phase by phase, where they run (here or on Ray), its plan."""
