-- ingest_progress.sql: how far ingest has stored each partition of the
-- defer topic.
--
-- What: one row per partition of :'topic' that ingest has stored from: the
-- offset of the next record it will store (every record below it is in
-- deferred_message or was rejected into it), when that position last moved,
-- and the epoch (bumped when Kafka went back in time). Kafka's high-water
-- mark minus next_offset is how many records wait to be ingested; the
-- console and the scheduler_ingest_lag_records metric show that, psql
-- cannot ask Kafka. A partition whose position has not moved for long while
-- its lag is above zero is stuck (see the README's alerts).
-- When: records were produced to the defer topic and do not show up; the
-- overview says ingest is behind.
-- Call:
--   psql "$DATABASE_URL" -v topic=scheduler.defer -f sql/runbook/ingest_progress.sql
SELECT partition,
       next_offset,
       updated_at,
       extract(epoch FROM now() - updated_at)::float8 AS idle_seconds,
       epoch
FROM ingest_offset
WHERE topic = :'topic'
ORDER BY partition;
