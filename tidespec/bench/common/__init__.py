"""Helpers every benchmark command shares: ``report`` (the run document: command, machine, tables,
plots, ``results.json``) and ``divergence`` (where two token streams first differ, and why).
"""
