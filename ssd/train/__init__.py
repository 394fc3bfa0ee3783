"""Training draft heads on the user's own machine (`ssd train-draft`)."""
