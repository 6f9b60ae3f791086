"""What a run costs: spot machines, their prices and interruptions, and energy."""
