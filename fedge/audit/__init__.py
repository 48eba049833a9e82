"""``fedge audit``: measurements of what a finished run reveals (``fedge audit privacy RUN_DIR``).

:mod:`~fedge.audit.mnd` holds the metric (numpy), :mod:`~fedge.audit.findings`
what the audit found about one generator, :mod:`~fedge.audit.networks` the two
small networks the audit trains (a fixed feature network, a feature inverter),
:mod:`~fedge.audit.report` the table and figures of the findings and
:mod:`~fedge.audit.privacy` the audit of a run directory.
"""
