-- Lease up to $1 dead-letter copies to publish: parked messages that name a
-- dead-letter topic, whose copy has not been acknowledged yet and that no
-- publisher holds (dlq_leased_until unset or passed), oldest first, within
-- $3 bytes (bigint: record keys, values and header values, counted as
-- dispatch_claim.sql counts them; the first copy always comes, however
-- large, and the rows beyond the budget are locked by this statement only,
-- not leased, so they stay claimable). The
-- lease runs until now() + $2 (interval), which must outlast the longest
-- publish. It commits with this statement: the caller publishes with no
-- transaction open (docs/design.md section 4.5), then marks what the broker
-- acknowledged (dlq_mark_published.sql) and backs off what failed
-- (dlq_back_off.sql), each in a short statement of its own. Holding no row
-- lock across the publish keeps vacuum going and lets an operator replay or
-- delete a row being published at once. A lease that passes (its publisher
-- crashed) makes the copy claimable again; SKIP LOCKED only keeps two
-- publishers claiming at the same instant off each other's rows.
--
-- Returns what the copy carries: the record and the failure context, and
-- parked_at, which names this stay in the parking lot: the mark and the
-- back-off apply only while it is unchanged. Ingest sets parked_at on the
-- rows it parks (ingest_insert.sql) and the touch trigger on every UPDATE
-- that parks; a row inserted parked by other means (plain SQL, or a
-- version before ingest set it) has none: it was parked when it was last
-- written, and its parked_at is set to that now, before this very
-- statement moves updated_at.
WITH picked AS MATERIALIZED (
    SELECT id
    FROM deferred_message
    WHERE state = 'parked' AND dlq_topic IS NOT NULL AND dlq_published_at IS NULL
      AND (dlq_leased_until IS NULL OR dlq_leased_until <= now())
    ORDER BY id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
), sized AS (
    -- A window function cannot sit beside FOR UPDATE: the sum is taken
    -- over the rows picked above. octet_length reads a TOASTed value's size
    -- without fetching the value.
    SELECT m.id,
           coalesce(sum(coalesce(octet_length(m.key), 0) + coalesce(octet_length(m.value), 0)
                        + coalesce((SELECT sum(octet_length(h)) FROM unnest(m.header_values) AS h)::bigint, 0))
                    OVER (ORDER BY m.id ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS bytes_before
    FROM deferred_message m
    JOIN picked p ON p.id = m.id
)
UPDATE deferred_message m
SET dlq_leased_until = now() + $2::interval,
    parked_at = coalesce(m.parked_at, m.updated_at)
FROM sized p
WHERE m.id = p.id AND p.bytes_before < $3::bigint
RETURNING m.id, m.seq, m.target_topic, m.attempt, m.redrive_count, m.dlq_topic, m.reason, m.error_class,
          m.error_message, m.parked_at, m.source_topic, m.source_partition, m.source_offset,
          m.key, m.value, m.header_keys, m.header_values
