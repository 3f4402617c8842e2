"""The kill record: what a killed task writes at the end of its log, once, after its unwind.

One room for the record as a document: [`document`][cancellable_agents.airflow.kill_record.document]
renders and parses it (Airflow-free; every reader of a task log uses its parser),
[`outlook`][cancellable_agents.airflow.kill_record._outlook] holds the Airflow facts it names (the
retry outlook, Airflow's own lines that follow it), and
[`task_log`][cancellable_agents.airflow.kill_record._task_log] writes it;
[`stored`][cancellable_agents.airflow.kill_record._stored] keeps it for the Cancellations view, with
a try's [`try_facts`][cancellable_agents.airflow.kill_record._try_facts] (wind-downs, resume, waits)
for a try that was not killed. What it is made of, the scope's
timeline and the processes its unwind stopped, is the scope's own
([`cancellable_agents.core.timeline`][]), below every layer that records a kill.
"""
