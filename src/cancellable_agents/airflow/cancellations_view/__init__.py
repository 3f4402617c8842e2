"""The Cancellations view: an Airflow 3.1+ UI plugin that shows each killed try's stored record
(a tab on the task instance page) and the kills across the fleet (a page in the nav).

It reads only what ``airflow/kill_record/_stored.py`` wrote into
Airflow's task state store; every endpoint is authorized by Airflow's auth manager as the
built-in routes are. The plugin class is light to import (every component imports it); the
FastAPI app and its queries load on the API server's first use.
"""
