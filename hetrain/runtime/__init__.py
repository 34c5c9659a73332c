"""Stage 3, train under a plan with torch.distributed (torchtitan's split):

``model`` the plain GPT; ``parallelize`` tensor parallelism and the gradient sync of
heterogeneous pipelines; ``precision`` autocast and loss scaling; ``groups`` the process
groups of a plan; ``data`` token sources; ``trainer`` one rank's loop; ``rank`` the process
around it; ``launch`` starts the processes (``worker`` is each one's entry point). ``schedule`` and ``instrument`` are the LR
schedule and the memory meter. May import ``spec``, ``plan``, ``config``, ``checkpoint``;
never ``solver`` or Prefect.
"""
