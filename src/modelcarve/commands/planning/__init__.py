"""What ``plan``, ``estimate`` and ``selfhost`` share beside their own modules: the serving goals'
flags and output (``serving_plan``), the frontier and disaggregated views (``frontier``), prices
(``pricing``), which goals serve and the dtypes a serving layout means (``serve_goals``), and the
``--emit-launch`` / ``--engine`` glue (``launch_emit``)."""
