-- Ask ingest, in every scheduler process that listens, to write the
-- batches it holds now, lingering or not (docs/design.md section 23.2): a
-- key-state query that finds ingest short of the defer topic's high-water
-- marks sends it, so that its answer does not wait out INGEST_FUTURE_LINGER.
-- $1 is the channel, queries.IngestFlushChannel. No columns: pg_notify
-- returns void.
SELECT FROM pg_notify($1, '')
