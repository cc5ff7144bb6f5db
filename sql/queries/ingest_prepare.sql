-- Ingest by COPY, the statement before it: in the transaction that then
-- copies the batches' rows into deferred_message (internal/defer/ingest's
-- Store), check and move the stored positions of batches of records read
-- from partitions of the defer topic $1, move the sequences past the
-- writer's high-water marks, and draw the ids and seqs of the rows to copy.
-- COPY writes the rows with about a third less of Postgres's CPU than
-- ingest_insert.sql's INSERT ... SELECT FROM unnest (docs/benchmarks.md,
-- "Ingest by COPY"), but it can neither check a position, nor draw a seq
-- only where a re-deferral brings none, nor say what it drew: this does
-- those three, and the caller copies exactly what it would have inserted.
--
-- Per batch, one element each: $2 the partition, $3 its next offset to
-- read once stored, $4 the position the writer left it at (-1: no
-- position stored yet), $5 its epoch, $6 how many records it holds and $7
-- how many of them need a fresh seq (every one but a re-deferral, which
-- keeps the seq it carries). $8 and $9 are the writer's highest id and seq
-- seen (see ingest_insert.sql and deferred_sequences_advance).
--
-- The continuity check is ingest_insert.sql's, word for word (internal/
-- defer/ingest's TestWritesShareTheirContinuityCheck): a batch
-- whose stored position is not ($4, $5) is not matched, and its records
-- must not be copied; the position row stays locked by this statement to
-- the end of the transaction, so a concurrent writer with the same
-- expectation waits and then finds it moved.
--
-- Returns one row: the transaction's now() (next_run_at of a record with a
-- delay is now() plus the delay, counted from the database clock the
-- dispatcher also uses, exactly as ingest_insert.sql computes it; and
-- created_at, updated_at and a parked row's parked_at are that same
-- now()), the partitions whose position matched, and the ids and the fresh
-- seqs of their records, drawn in order after the sequences moved: the
-- records of the matched batches in the order the batches were given, in
-- offset order within each, take them one after the other, as the INSERT
-- hands them out. Nothing is drawn when no batch matched.
WITH batch AS (
    SELECT * FROM unnest($2::int[], $3::bigint[], $4::bigint[], $5::int[], $6::int[], $7::int[])
        AS b (partition, next_offset, expected, epoch, records, fresh_seqs)
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
), wanted AS MATERIALIZED (
    SELECT coalesce(sum(b.records), 0)::int AS ids, coalesce(sum(b.fresh_seqs), 0)::int AS seqs
    FROM batch b WHERE b.partition IN (SELECT partition FROM position)
), advanced AS MATERIALIZED (
    -- Only when something is to be drawn, and before the first draw: each
    -- draw below reads this CTE, which runs once, whole, on its first read.
    SELECT * FROM deferred_sequences_advance($8, $9) WHERE (SELECT ids FROM wanted) > 0
)
SELECT now() AS now,
       ARRAY(SELECT partition FROM position ORDER BY partition)::int[] AS matched,
       ARRAY(SELECT nextval('deferred_message_id_seq')
             FROM advanced CROSS JOIN generate_series(1, (SELECT ids FROM wanted)) AS g (n)
             ORDER BY g.n) AS ids,
       ARRAY(SELECT nextval('deferred_message_seq')
             FROM advanced CROSS JOIN generate_series(1, (SELECT seqs FROM wanted)) AS g (n)
             ORDER BY g.n) AS seqs
