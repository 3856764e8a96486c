"""The pytest plugin of the suite (``pytest_plugins = ["dcpcheck.plugin"]``),
one module per concern:

* :mod:`.options`: the command-line options and how they are read;
* :mod:`.session`: the session state (implementation, device, world sizes,
  the launcher of ranks) from configure to session end;
* :mod:`.markers`: the markers, the world-size parametrization, and every
  skip, decided at collection;
* :mod:`.runner`: the ``dcp`` fixture that runs a rank function on W ranks;
* :mod:`.known_failures`: a known defect's case that fails otherwise fails;
* :mod:`.impl_answers`: what the implementation gives the harness (its
  attributes at session start, its answers before each case), checked;
* :mod:`.stage_table`: the stage x outcome table at the end of a run;
* :mod:`.file_durations`: each test file's measured duration, for the
  schedulers that hand out the longest files first.

Every skip is decided before any rank is launched, from the options, the
environment and the implementation's capabilities: the same on every rank.
"""

pytest_plugins = [
    "dcpcheck.plugin.options",
    "dcpcheck.plugin.session",
    "dcpcheck.plugin.markers",
    "dcpcheck.plugin.runner",
    "dcpcheck.plugin.known_failures",
    "dcpcheck.plugin.stage_table",
    "dcpcheck.plugin.file_durations",
]
