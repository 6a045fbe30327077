"""What the workers cache, as the router knows it: the KV index and its lower tiers, the event feed, predictions, prefix pulls."""
