-- Store the batches of records read from partitions of the defer topic $1,
-- one batch per partition, in one statement: a lone batch, or several that
-- ingest's writers combined because they were ready at once (see
-- internal/defer/ingest's writer; one statement's fixed cost, its
-- triggers' statements included, is then paid once for all of them).
-- Ingest uses it for writes of fewer than 50 records, and for a larger one
-- whose COPY found a record stored before; the rest go in by COPY
-- (ingest_prepare.sql, and internal/defer/ingest's Store, say why).
-- Per batch, one element each: $2 the partition, $25 its epoch (see
-- migration 0005), $20 its next offset to read, recorded by the same
-- statement so that the rows and the position commit together (see
-- ingest_offset), $24 the position the writer left it at (-1: no position
-- stored yet). Every other parameter is an array with one element per
-- record, the records of one batch together and in offset order: $30 the
-- partition of the record's batch, $3 source offset, $4 business key, $5
-- seq (NULL: a fresh one), $6 target, $7 due time, $8 delay in
-- microseconds, $9 attempt, $10 state, $11 reason, $12 error class, $13
-- error message, $14 origin id, $15 key, $16 value, $21 park_holds_key,
-- $22 dead-letter topic, $23 redrive count, $28 consumer group
-- (defer.group), $29 gated (defer.gated). Only the header arrays $17-$19
-- differ: they list every header of the statement in order, each with the
-- 1-based position of its record in $17.
--
-- The continuity check, per batch: a batch is stored only if its
-- partition's stored position is still ($24, $25), where this writer left
-- it. Otherwise none of that batch is written and its row says matched =
-- false: Postgres went back in time under the writer (a failover to a
-- lagging replica, a restore), or another writer (a member that lost the
-- partition in a rebalance) stored past it. Either way the writer must read
-- the partition again from the stored position; checking here costs no
-- round trip. A concurrent writer with the same expectation waits for the
-- row lock and then finds the position moved. The other batches of the
-- statement are stored all the same.
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
-- Returns one row per batch, in partition order: its partition, whether its
-- position matched, how many rows were stored, how many of those were
-- rejected, how many parked and how many gated (stored pending behind a
-- blocked key), and the highest id and seq stored (NULL when none).
WITH batch AS (
    SELECT * FROM unnest($2::int[], $20::bigint[], $24::bigint[], $25::int[])
        AS b (partition, next_offset, expected, epoch)
), moved AS (
    UPDATE ingest_offset o SET next_offset = b.next_offset, updated_at = now()
    FROM batch b
    WHERE o.topic = $1 AND o.partition = b.partition AND o.next_offset = b.expected AND o.epoch = b.epoch
    RETURNING o.partition
), created AS (
    INSERT INTO ingest_offset (topic, partition, next_offset, epoch)
    SELECT $1, b.partition, b.next_offset, b.epoch FROM batch b WHERE b.expected = -1
    ORDER BY b.partition
    ON CONFLICT (topic, partition) DO NOTHING
    RETURNING partition
), position AS MATERIALIZED (
    SELECT partition FROM moved UNION ALL SELECT partition FROM created
), matched AS MATERIALIZED (
    SELECT b.partition, b.epoch FROM batch b WHERE b.partition IN (SELECT partition FROM position)
), advanced AS (
    SELECT * FROM deferred_sequences_advance($26, $27)
), headers AS (
    -- Each record's headers, in order. The arrays come in (record,
    -- position) order, and the subquery's ORDER BY says so to the planner,
    -- so that array_agg takes them as they come: PostgreSQL 15 runs an
    -- aggregate's own ORDER BY as one sort per group, a thousand sorts for
    -- a batch of a thousand records (2-3 µs per record, docs/benchmarks.md,
    -- "Three plans fixed"). With no join at this level, the grouping
    -- reads the subquery's rows in its order (PostgreSQL's documentation,
    -- "Aggregate Expressions").
    SELECT h.record, array_agg(h.key) AS keys, array_agg(h.value) AS vals
    FROM (SELECT * FROM unnest($17::int[], $18::text[], $19::bytea[]) WITH ORDINALITY AS h (record, key, value, position)
          ORDER BY h.record, h.position) h
    GROUP BY h.record
), inserted AS (
INSERT INTO deferred_message (
    source_topic, source_partition, source_epoch, source_offset, business_key, seq, target_topic,
    next_run_at, attempt, state, reason, error_class, error_message, origin_id,
    key, value, header_keys, header_values, park_holds_key, parked_at, dlq_topic, redrive_count, group_id, gated)
SELECT $1::text, r.partition, b.epoch, r.source_offset, r.business_key, coalesce(r.seq, nextval('deferred_message_seq')), r.target_topic,
       coalesce(r.run_at, now() + r.delay_us * interval '1 microsecond'), r.attempt, r.state, r.reason,
       r.error_class, r.error_message, r.origin_id,
       r.key, r.value, coalesce(h.keys, '{}'), coalesce(h.vals, '{}'),
       r.park_holds_key, CASE WHEN r.state = 'parked' THEN now() END, r.dlq_topic, r.redrive_count, r.group_id,
       r.gated
FROM unnest($30::int[], $3::bigint[], $4::text[], $5::bigint[], $6::text[], $7::timestamptz[], $8::bigint[], $9::int[],
            $10::text[], $11::text[], $12::text[], $13::text[], $14::bigint[], $15::bytea[], $16::bytea[],
            $21::boolean[], $22::text[], $23::int[], $28::text[], $29::boolean[])
     WITH ORDINALITY AS r (partition, source_offset, business_key, seq, target_topic, run_at, delay_us, attempt,
                           state, reason, error_class, error_message, origin_id, key, value,
                           park_holds_key, dlq_topic, redrive_count, group_id, gated, record)
-- Only the batches whose position matched; matched is materialized, so
-- the positions are moved before the first row is built.
JOIN matched b ON b.partition = r.partition
LEFT JOIN headers h ON h.record = r.record
-- A one-time filter, evaluated before the first row is built, so before
-- the first id and seq are drawn.
WHERE EXISTS (SELECT FROM advanced)
-- Sorting first makes nextval hand out seq in offset order within each
-- batch (Postgres evaluates volatile output expressions after the sort).
ORDER BY r.record
ON CONFLICT (source_topic, source_partition, source_epoch, source_offset) DO NOTHING
RETURNING source_partition, id, seq, state, gated
)
SELECT b.partition, b.partition IN (SELECT partition FROM position) AS matched, count(i.id) AS stored,
       count(i.id) FILTER (WHERE i.state = 'rejected') AS rejected,
       count(i.id) FILTER (WHERE i.state = 'parked') AS parked,
       count(i.id) FILTER (WHERE i.state = 'pending' AND i.gated) AS gated, max(i.id) AS max_id, max(i.seq) AS max_seq
FROM batch b
LEFT JOIN inserted i ON i.source_partition = b.partition
GROUP BY b.partition
ORDER BY b.partition
