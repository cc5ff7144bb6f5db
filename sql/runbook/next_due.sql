-- next_due.sql: the next pending messages to come due.
--
-- What: up to :limit pending messages in next_run_at order, with how long
-- until each is due (negative: late) and whether it is the head of its
-- business key. A message that is not its key's head waits behind the head
-- however early its own next_run_at is: per-key order comes first.
-- When: to see what goes out next, or why a message has not gone out yet.
-- Call:
--   psql "$DATABASE_URL" -v limit=20 -f sql/runbook/next_due.sql
SELECT m.id,
       m.business_key,
       m.seq,
       m.target_topic,
       m.next_run_at,
       date_trunc('second', m.next_run_at - now()) AS due_in,
       k.head_id IS NOT NULL AS is_head,
       m.attempt
FROM deferred_message m
LEFT JOIN deferred_key k ON k.head_id = m.id
WHERE m.state = 'pending'
ORDER BY m.next_run_at, m.id
LIMIT :limit;
