"""Measurement and command-line tools built on the library (not needed to compute attention).

* :mod:`~sparseattn.tools.bench` -- one comparison: selectors against exact attention on one workload;
* :mod:`~sparseattn.tools.suite` -- benchmark suites, each case in a fresh interpreter;
* :mod:`~sparseattn.tools.report` -- tables (terminal, Markdown, HTML) and plots of those results;
* :mod:`~sparseattn.tools.decode_report` -- the decode workload of :class:`sparseattn.KVCache`, measured;
* :mod:`~sparseattn.tools.traces` -- real Q/K/V capture from MiniLM (optional ``traces`` extra);
* :mod:`~sparseattn.tools.cli` -- the ``sparseattn`` command;
* :mod:`~sparseattn.tools.args` -- argument checks shared by the command and the benchmark scripts.

The library under ``sparseattn`` never imports this package; it imports the library.
"""
