"""Renting: which GPUs to rent from offers for an objective (``solver.rent.offers.choose_rental``), and the plan
over a large rental as the offers' reference plans repeated (``solver.rent.rental_plan``). Above the planners:
it plans through the registry."""
