-- Claim up to $1 due heads of the rate-limited target $5 that no one holds,
-- lease them to $4 until now() + $2, and return, for each, its consecutive
-- due pending messages in order, at most $3 per key (the caller took one
-- token of the target's rate limit per head it asks for, and passes $3 = 1:
-- one token pays for one message). A paused target yields nothing. See
-- dispatch_claim.sql, the main claim, for the rest: from "claimed AS" on,
-- this is that file word for word.
--
-- Reads deferred_key_throttled from ($5, -infinity): only this target's due
-- heads, however large the backlog of other paused or limited targets. A
-- head of $5 left unflagged by a race with the operator's change that
-- limited it (migration 0002) is not seen here until maintenance flags it.
WITH due AS MATERIALIZED (
    SELECT ctid
    FROM deferred_key
    WHERE throttled
      AND head_target = $5::text
      AND next_run_at <= now()
      AND (leased_until IS NULL OR leased_until <= now())
      -- On $5, not on head_target: one check for the whole claim, which
      -- the planner does not mistake for a filter of the heads' rows.
      AND NOT EXISTS (SELECT 1 FROM target_control c WHERE c.target_topic = $5::text AND c.paused)
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
SELECT c.business_key, c.head_id, m.id, m.seq, m.target_topic, m.next_run_at, m.attempt, m.redrive_count,
       m.key, m.value, m.header_keys, m.header_values
FROM claimed c
LEFT JOIN LATERAL (
    SELECT s.id, s.seq, s.target_topic, s.next_run_at, s.attempt, s.redrive_count, s.key, s.value,
           s.header_keys, s.header_values
    FROM (
        SELECT m.*, bool_and(m.state = 'pending' AND m.next_run_at <= now()) OVER (ORDER BY m.seq, m.id) AS all_due
        FROM deferred_message m
        WHERE c.business_key IS NOT NULL AND m.business_key = c.business_key
          -- The head candidates (deferred_message_key_order's predicate),
          -- so that a parked message holding the key ends the run.
          AND (m.state = 'pending' OR (m.state = 'parked' AND m.park_holds_key))
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
    SELECT m.id, m.seq, m.target_topic, m.next_run_at, m.attempt, m.redrive_count, m.key, m.value,
           m.header_keys, m.header_values
    FROM deferred_message m
    WHERE c.business_key IS NULL AND m.id = c.head_id AND m.state = 'pending' AND m.next_run_at <= now()
) m ON true
ORDER BY c.business_key, c.head_id, m.seq, m.id
