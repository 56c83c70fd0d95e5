"""
The connection form of each backend: connection type, settings table and form fields, one module per
backend named like its hook module. Nothing here imports Airflow, which reads these while it starts.
"""
