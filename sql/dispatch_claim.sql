-- Claim up to $1 due heads that no one holds, lease them to $4 until now() +
-- $2, and return, for each, its consecutive due pending messages in order (at
-- most $3 per key; unordered heads are one message). The lease commits with
-- this statement: publishing happens after, outside any transaction.
--
-- MATERIALIZED keeps the LIMIT and SKIP LOCKED in one place: without it the
-- planner may inline the CTE into the UPDATE and lock more rows than asked.
-- A claimed key for which no message comes back (an operator changed it an
-- instant ago) still returns one row with id NULL so the caller can release it.
WITH due AS MATERIALIZED (
    SELECT ctid
    FROM deferred_key
    WHERE next_run_at <= now()
      AND (leased_until IS NULL OR leased_until <= now())
      AND NOT EXISTS (SELECT 1 FROM target_control c WHERE c.target_topic = head_target AND c.paused)
    ORDER BY next_run_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE deferred_key k
    SET leased_until = now() + $2::interval, leased_by = $4::text
    FROM due
    WHERE k.ctid = due.ctid
    RETURNING k.business_key, k.head_id, k.head_seq
)
SELECT c.business_key, c.head_id, m.id, m.seq, m.target_topic, m.next_run_at, m.attempt,
       m.key, m.value, m.header_keys, m.header_values
FROM claimed c
LEFT JOIN LATERAL (
    SELECT s.id, s.seq, s.target_topic, s.next_run_at, s.attempt, s.key, s.value, s.header_keys, s.header_values
    FROM (
        SELECT m.*, bool_and(m.next_run_at <= now()) OVER (ORDER BY m.seq, m.id) AS all_due
        FROM deferred_message m
        WHERE c.business_key IS NOT NULL AND m.business_key = c.business_key AND m.state = 'pending'
          -- Never hand out anything before the head the claim leased. The
          -- ctid join above already skips a head that changed after this
          -- statement's snapshot; this keeps the read right even if that
          -- join changes.
          AND (m.seq, m.id) >= (c.head_seq, c.head_id)
        ORDER BY m.seq, m.id
        LIMIT $3
    ) s
    WHERE s.all_due
    UNION ALL
    SELECT m.id, m.seq, m.target_topic, m.next_run_at, m.attempt, m.key, m.value, m.header_keys, m.header_values
    FROM deferred_message m
    WHERE c.business_key IS NULL AND m.id = c.head_id AND m.state = 'pending' AND m.next_run_at <= now()
) m ON true
ORDER BY c.business_key, c.head_id, m.seq, m.id
