"""How a worker is chosen: load, timing, the cost and the policies, fleet-scale candidate bounds, the decision."""
