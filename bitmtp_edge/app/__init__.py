"""What users run: the ``bitmtp`` command line (``cli``) and the programs behind its commands
(``chat``, ``demo``, ``serve``, ``bench`` + ``bench_report``, ``doctor``)."""
