"""Everything Airflow-specific: the mixin, the retry policy, and the adapter that holds every
Airflow fact and version shim. The rest of the package imports no Airflow."""
