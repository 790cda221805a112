"""``gradmon-ray train``: a run (``run``), its command (``command``), resumable checkpoints
(``checkpoints``), ``--resume`` (``resume``), Ctrl-C/SIGTERM (``interrupts``) and what it prints
(``messages``).  Import each name from its module: this package re-exports nothing."""
