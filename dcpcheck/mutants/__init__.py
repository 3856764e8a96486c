"""Mutants of the embedded port: each one is the port with exactly one
realistic DCP bug, described as data (a patch of one port file), loadable
with ``--dcp-impl dcpcheck.mutants.catalog:<Name>``.

``tools/mutation_report.py`` runs the stage tests against every mutant and
reports which test kills it: a mutant that survives is a hole in the suite.
"""
