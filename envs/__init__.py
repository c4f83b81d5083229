"""Text environments for agent RL: engines, a pooled HTTP service, and its client.

Nothing in here imports from the Flower side (fl_app, server_app, client_app).
"""
