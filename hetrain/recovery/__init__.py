"""Stage 5, keep a run going: ``runs`` starts or resumes a run by name (the CLI's and the flows'
lifecycle), ``preemption`` watches the clouds' notices, ``recover`` re-plans for the survivors,
reassembles and relaunches. Control plane: never imports the training internals
(``runtime.trainer``, ``runtime.parallelize``, ``checkpoint.save``); the planner is passed in.
"""
