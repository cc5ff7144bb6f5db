-- Claim up to $1 due heads that no one holds, lease them to $4 until now() +
-- $2, and return, for each, its consecutive due pending messages in order (at
-- most $3 per key; unordered heads are one message). The lease commits with
-- this statement: publishing happens after, outside any transaction. This is
-- the main claim: heads of every target that is neither paused nor
-- rate-limited. A rate-limited target's heads are claimed with
-- dispatch_claim_target.sql, whose message read (from "claimed AS" on) is
-- this one's, word for word.
--
-- Heads of paused and rate-limited targets are flagged (deferred_key.throttled)
-- and are not in deferred_key_due's range at all, so however large their
-- backlog, this walks only heads that can go. The target_control check
-- below is a safety net, not the filter: a head written while an operator
-- was pausing or limiting its target may be left unflagged for a while (see
-- "Throttled heads under concurrency" in migration 0002); the check still
-- keeps it from being sent, at the cost of a skipped row. It reads
-- target_control once, into an array, rather than as NOT EXISTS per head:
-- the planner, taking an anti-join to remove many rows, would otherwise
-- sort every due head to find the first $1 when target_control has no
-- statistics yet (seen: 50ms for 100k due heads, against 0.3ms).
--
-- A key held by a parked message (deferred_key.held) has next_run_at =
-- 'infinity' and is never due, so the range scan below never reaches it. A
-- run stops at the first message that is not due, and also at a parked
-- message that holds the key: the head is pending, but a later message
-- must still not overtake a parked one ahead of it.
--
-- MATERIALIZED keeps the LIMIT and SKIP LOCKED in one place: without it the
-- planner may inline the CTE into the UPDATE and lock more rows than asked.
-- A claimed key for which no message comes back (an operator changed it an
-- instant ago) still returns one row with id NULL so the caller can release it.
WITH due AS MATERIALIZED (
    SELECT ctid
    FROM deferred_key
    WHERE NOT throttled
      AND next_run_at <= now()
      AND (leased_until IS NULL OR leased_until <= now())
      -- coalesce(..., false) filters exactly as the bare test would, but
      -- hides it from the row estimate: with one target, the statistics
      -- say every head goes to it, the planner takes "not one of the
      -- throttled targets" to keep no row at all, and sorts every due
      -- head for the LIMIT instead of walking deferred_key_due (seen: all
      -- 20,000 due heads read per claim; see migration 0003).
      AND coalesce(head_target <> ALL (ARRAY(SELECT c.target_topic FROM target_control c
                                             WHERE c.paused OR c.rate_limit IS NOT NULL)), false)
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
