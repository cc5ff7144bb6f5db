-- Store one batch of records read from one partition of the defer topic.
-- $1 and $2 are the source topic and partition, $25 the partition's epoch
-- (see migration 0005); $20 is the partition's next offset to read, recorded
-- by the same statement so that the rows and the position commit together
-- (see ingest_offset). Every other parameter is an array with one element
-- per record: $3 source offset, $4 business key, $5 seq (NULL: a fresh one),
-- $6 target, $7 due time, $8 delay in microseconds, $9 attempt, $10 state,
-- $11 reason, $12 error class, $13 error message, $14 origin id, $15 key,
-- $16 value, $21 park_holds_key, $22 dead-letter topic, $23 redrive count,
-- $28 consumer group (defer.group), $29 gated (defer.gated).
-- Only the header arrays $17-$19 differ: they list every header of the
-- batch in order, each with the 1-based position of its record in $17.
--
-- The continuity check: the batch is stored only if the partition's stored
-- position is still ($24, $25), where this writer left it ($24 = -1: no
-- position stored yet). Otherwise nothing is written and the first column
-- is false: Postgres went back in time under the writer (a failover to a
-- lagging replica, a restore), or another writer (a member that lost the
-- partition in a rebalance) stored past it. Either way the writer must read
-- the partition again from the stored position; checking here costs no
-- round trip. A concurrent writer with the same expectation waits for the
-- row lock and then finds the position moved.
--
-- A record already stored (same topic, partition, epoch and offset) is
-- skipped, a safety net now that the position is checked. next_run_at comes
-- from $7 when set, else now() plus the delay in $8, so that delays count
-- from the database clock the dispatcher also uses. A row stored as parked
-- is parked now (the touch trigger sets parked_at only on UPDATE).
--
-- $26 and $27 are the highest id and seq the writer has seen: before any
-- is drawn, deferred_sequences_advance moves the sequences past them if
-- they are behind, which only a database that went back in time does (see
-- migration 0005): no id consumers saw is handed to another message.
--
-- Returns whether the position matched, how many rows were stored, how many
-- of those were rejected, how many parked and how many gated (stored
-- pending behind a blocked key), and the highest id and seq stored (NULL
-- when none).
WITH moved AS (
    UPDATE ingest_offset SET next_offset = $20, updated_at = now()
    WHERE topic = $1 AND partition = $2 AND next_offset = $24 AND epoch = $25
    RETURNING 1
), created AS (
    INSERT INTO ingest_offset (topic, partition, next_offset, epoch)
    SELECT $1, $2, $20, $25 WHERE $24::bigint = -1
    ON CONFLICT (topic, partition) DO NOTHING
    RETURNING 1
), position AS (
    SELECT 1 FROM moved UNION ALL SELECT 1 FROM created
), advanced AS (
    SELECT * FROM deferred_sequences_advance($26, $27)
), headers AS (
    SELECT h.record, array_agg(h.key ORDER BY h.position) AS keys, array_agg(h.value ORDER BY h.position) AS vals
    FROM unnest($17::int[], $18::text[], $19::bytea[]) WITH ORDINALITY AS h (record, key, value, position)
    GROUP BY h.record
), inserted AS (
INSERT INTO deferred_message (
    source_topic, source_partition, source_epoch, source_offset, business_key, seq, target_topic,
    next_run_at, attempt, state, reason, error_class, error_message, origin_id,
    key, value, header_keys, header_values, park_holds_key, parked_at, dlq_topic, redrive_count, group_id, gated)
SELECT $1::text, $2::int, $25::int, r.source_offset, r.business_key, coalesce(r.seq, nextval('deferred_message_seq')), r.target_topic,
       coalesce(r.run_at, now() + r.delay_us * interval '1 microsecond'), r.attempt, r.state, r.reason,
       r.error_class, r.error_message, r.origin_id,
       r.key, r.value, coalesce(h.keys, '{}'), coalesce(h.vals, '{}'),
       r.park_holds_key, CASE WHEN r.state = 'parked' THEN now() END, r.dlq_topic, r.redrive_count, r.group_id,
       r.gated
FROM unnest($3::bigint[], $4::text[], $5::bigint[], $6::text[], $7::timestamptz[], $8::bigint[], $9::int[],
            $10::text[], $11::text[], $12::text[], $13::text[], $14::bigint[], $15::bytea[], $16::bytea[],
            $21::boolean[], $22::text[], $23::int[], $28::text[], $29::boolean[])
     WITH ORDINALITY AS r (source_offset, business_key, seq, target_topic, run_at, delay_us, attempt,
                           state, reason, error_class, error_message, origin_id, key, value,
                           park_holds_key, dlq_topic, redrive_count, group_id, gated, record)
LEFT JOIN headers h ON h.record = r.record
-- Both are one-time filters, evaluated before the first row is built, so
-- before the first id and seq are drawn.
WHERE EXISTS (SELECT FROM position) AND EXISTS (SELECT FROM advanced)
-- Sorting first makes nextval hand out seq in offset order (Postgres evaluates
-- volatile output expressions after the sort).
ORDER BY r.record
ON CONFLICT (source_topic, source_partition, source_epoch, source_offset) DO NOTHING
RETURNING id, seq, state, gated
)
SELECT EXISTS (SELECT FROM position) AS matched, count(*) AS stored,
       count(*) FILTER (WHERE state = 'rejected') AS rejected,
       count(*) FILTER (WHERE state = 'parked') AS parked,
       count(*) FILTER (WHERE state = 'pending' AND gated) AS gated, max(id) AS max_id, max(seq) AS max_seq
FROM inserted
