"""Reproducing the papers: a grid of runs (``grid``), what a run directory says about its run
(``runs``), the papers' published numbers (``papers``) and the report with its plots (``report``,
``plots``)."""
