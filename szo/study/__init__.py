"""Evidence studies (issue 13): ZO-estimate diagnostics and the subspace-origin ablation.

``szo diagnose RUN_DIR`` (:mod:`szo.study.diagnose`) and ``szo study subspaces BP_RUN``
(:mod:`szo.study.subspaces`); see docs/evidence.md.
"""
