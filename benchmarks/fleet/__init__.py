"""The fleet simulator behind scripts/simulate_fleet.py (docs/SCALING.md): step costs
(cost.py, measured by measure.py), a replica's scheduler on sizes (replica.py), the fleet's
events with conveyor's own router (sim.py), and the check against served runs (validate.py)."""
