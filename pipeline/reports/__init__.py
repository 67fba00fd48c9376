"""The reports: what the run chain's last stage writes and what is read off it afterwards.

- :mod:`~pipeline.reports.runs`: runs loaded from their directories, grouped into arms, and
  the verdicts both reports give;
- :mod:`~pipeline.reports.parity` (``python -m pipeline.reports.parity``): two or more arms
  side by side, the gate on samples to a fixed target (:mod:`~pipeline.reports.gate`);
- :mod:`~pipeline.reports.compare` (``python -m pipeline.reports.compare``): every strategy
  by samples-, bytes- and modelled time-to-target (:mod:`~pipeline.reports.timing`,
  :mod:`~pipeline.reports.ranking`, :mod:`~pipeline.reports.crossover`);
- what is read off a comparison: the advice for a cluster (``advise``), the pages that quote
  it (``pages``), the link model (``linkmodel``), the optimizer's mechanism (``mechanism``).

The run chain (:mod:`pipeline.experiment`) names a report only by its command line; a
report may import the chain's loaders (:mod:`pipeline.run_files`, :mod:`pipeline.tuning`),
never the reverse.
"""
