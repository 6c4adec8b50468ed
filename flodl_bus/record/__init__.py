"""The write side of records: what each process writes about itself, and the file format.

- ``chain``: the on-disk form (JSON lines in a digest chain closed by an ``end`` line,
  plain or in zstd frames) and the readers that verify it;
- ``log``: the console logger and ``Recorder`` (one chained line per event, redacted);
- ``dispatch``: the dispatch schema and ``DispatchRecorder`` (one run per record).

May import ``protocol`` and ``bus`` only: the cores and runtimes above use it, and
``replay`` (above the cores) reads what it wrote.
"""
