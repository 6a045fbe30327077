"""One request's stream through the router: attempts, legs, disaggregation and migration."""
