-- Store one batch of records read from one partition of the defer topic.
-- $1 and $2 are the source topic and partition; $20 is the partition's next
-- offset to read, recorded by the same statement so that the rows and the
-- offset commit together (see ingest_offset). Every other parameter is an
-- array with one element per record: $3 source offset, $4 business key,
-- $5 seq (NULL: a fresh one), $6 target, $7 due time, $8 delay in
-- microseconds, $9 attempt, $10 state, $11 reason, $12 error class,
-- $13 error message, $14 origin id, $15 key, $16 value, $21 park_holds_key,
-- $22 dead-letter topic, $23 redrive count. Only the header arrays $17-$19
-- differ: they list every header of the batch in order, each with the
-- 1-based position of its record in $17.
-- A record already stored (same topic, partition and offset) is skipped,
-- which makes ingest idempotent. next_run_at comes from $7 when set, else
-- now() plus the delay in $8, so that delays count from the database clock
-- the dispatcher also uses. A row stored as parked is parked now (the touch
-- trigger sets parked_at only on UPDATE).
-- Returns how many rows were stored, and how many of those were rejected and
-- how many parked.
WITH position AS (
    INSERT INTO ingest_offset AS o (topic, partition, next_offset) VALUES ($1, $2, $20)
    ON CONFLICT (topic, partition) DO UPDATE
        SET next_offset = greatest(o.next_offset, excluded.next_offset), updated_at = now()
), headers AS (
    SELECT h.record, array_agg(h.key ORDER BY h.position) AS keys, array_agg(h.value ORDER BY h.position) AS vals
    FROM unnest($17::int[], $18::text[], $19::bytea[]) WITH ORDINALITY AS h (record, key, value, position)
    GROUP BY h.record
), inserted AS (
INSERT INTO deferred_message (
    source_topic, source_partition, source_offset, business_key, seq, target_topic,
    next_run_at, attempt, state, reason, error_class, error_message, origin_id,
    key, value, header_keys, header_values, park_holds_key, parked_at, dlq_topic, redrive_count)
SELECT $1::text, $2::int, r.source_offset, r.business_key, coalesce(r.seq, nextval('deferred_message_seq')), r.target_topic,
       coalesce(r.run_at, now() + r.delay_us * interval '1 microsecond'), r.attempt, r.state, r.reason,
       r.error_class, r.error_message, r.origin_id,
       r.key, r.value, coalesce(h.keys, '{}'), coalesce(h.vals, '{}'),
       r.park_holds_key, CASE WHEN r.state = 'parked' THEN now() END, r.dlq_topic, r.redrive_count
FROM unnest($3::bigint[], $4::text[], $5::bigint[], $6::text[], $7::timestamptz[], $8::bigint[], $9::int[],
            $10::text[], $11::text[], $12::text[], $13::text[], $14::bigint[], $15::bytea[], $16::bytea[],
            $21::boolean[], $22::text[], $23::int[])
     WITH ORDINALITY AS r (source_offset, business_key, seq, target_topic, run_at, delay_us, attempt,
                           state, reason, error_class, error_message, origin_id, key, value,
                           park_holds_key, dlq_topic, redrive_count, record)
LEFT JOIN headers h ON h.record = r.record
-- Sorting first makes nextval hand out seq in offset order (Postgres evaluates
-- volatile output expressions after the sort).
ORDER BY r.record
ON CONFLICT (source_topic, source_partition, source_offset) DO NOTHING
RETURNING state
)
SELECT count(*), count(*) FILTER (WHERE state = 'rejected'), count(*) FILTER (WHERE state = 'parked') FROM inserted
